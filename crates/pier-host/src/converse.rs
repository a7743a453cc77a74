//! The conversation of one attempt, wherever its agent runs: the task's turn, then one more
//! turn on the same session for each batch of messages people sent it (`pier say`) while it
//! ran: queued ones when a turn ends with an answer, an interrupting one at once (the turn is
//! cancelled through the handshake to make room). A turn that answers with no message waiting
//! ends the attempt there, while the session is still open: a message that comes before that
//! ending's commit refuses it and is sent, one that comes after is refused (the task no longer
//! runs), so none is accepted and left unsent. The task's outcome is the last turn's; a stop
//! of the attempt (the host's, a lost lease) ends it as before.
//!
//! Written once for a host's own attempts ([`crate::attempt`], on the store) and a worker's
//! ([`crate::worker`], through the host's `/v1`): each brings its [`Channel`] to the task.

use std::future::Future;

use agent_client_protocol_schema::v1::{ContentBlock, StopReason, TextContent};
use pier_client::run::{Interrupts, LiveAgent, RunOutcome};
use pier_client::{ClientEvent, Ending, RunOptions, SessionTarget};
use tokio::sync::mpsc;

/// How an attempt reaches its task: the people's messages for it and its ending.
pub(crate) trait Channel {
    /// What applying the ending gave.
    type Ended;

    /// Resolves when a person's message asks to interrupt the running turn. Raced beside the
    /// turn in a `select!`, so it must be cancel-safe.
    fn interrupt(&mut self) -> impl Future<Output = ()> + Send;

    /// Ends the attempt with the turn's `outcome`, unless a person's message waits for the
    /// task: then `None`, nothing is ended, and the message goes to the agent next.
    fn end(&mut self, outcome: &RunOutcome) -> impl Future<Output = Option<Self::Ended>> + Send;

    /// People's messages for the task not sent yet, oldest first, taken.
    fn take_messages(&mut self) -> impl Future<Output = Vec<String>> + Send;
}

/// The task's turn on `agent` and the turns people's messages ask for, as the module says;
/// with the attempt's ending when the conversation applied it.
pub(crate) async fn converse<C: Channel>(
    agent: &mut LiveAgent,
    opts: &RunOptions,
    prompt: Vec<ContentBlock>,
    events: &mpsc::Sender<ClientEvent>,
    interrupts: &mut Interrupts,
    channel: &mut C,
) -> (RunOutcome, Option<C::Ended>) {
    let mut next = Some((prompt, None::<String>));
    loop {
        let Some((prompt, session)) = next.take() else { return (RunOutcome::failed(None), None) };
        // A channel per turn: an interrupt meant for one turn never cancels the next.
        let (cancel_turn, mut turn_interrupts) = mpsc::unbounded_channel();
        let (mut stopped, mut for_message) = (false, false);
        let outcome = {
            let turn = async {
                match session {
                    None => agent.turn(opts, SessionTarget::New, prompt, events, &mut turn_interrupts).await,
                    Some(id) => agent.continue_turn(opts, id, prompt, events, &mut turn_interrupts).await,
                }
            };
            tokio::pin!(turn);
            loop {
                tokio::select! {
                    outcome = &mut turn => break outcome,
                    Some(()) = interrupts.recv(), if !stopped => {
                        stopped = true;
                        let _ = cancel_turn.send(());
                    }
                    () = channel.interrupt(), if !stopped && !for_message => {
                        for_message = true;
                        let _ = cancel_turn.send(());
                    }
                }
            }
        };
        let answered = outcome.ending == Ending::Answered
            && outcome.stop_reason == Some(StopReason::EndTurn)
            && outcome.error.is_none();
        // Cancelled to make room for a message, or answered before the cancel landed: either
        // way the session is there and the message goes next.
        let made_room = for_message && outcome.stop_reason.is_some() && outcome.error.is_none();
        let Some(session) = outcome.session_id.clone() else { return (outcome, None) };
        if stopped || !(answered || made_room) {
            return (outcome, None);
        }
        if answered && let Some(ended) = channel.end(&outcome).await {
            return (outcome, Some(ended));
        }
        let messages = channel.take_messages().await;
        if messages.is_empty() {
            return (outcome, None);
        }
        next = Some((vec![ContentBlock::Text(TextContent::new(messages.join("\n\n")))], Some(session)));
    }
}
