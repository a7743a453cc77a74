//! Session modes and config options (editor profile).
//!
//! The mode is offered twice, as `modes` and as a `configOptions` select of
//! category `mode` (R124); changing either view sends the other (R127). Where
//! several models are configured, a `model` select chooses the session's model.

use std::sync::Arc;

use agent_client_protocol_schema::v1::{
    ConfigOptionUpdate, CurrentModeUpdate, Error, SessionConfigOption, SessionConfigOptionCategory,
    SessionConfigSelectOption, SessionMode, SessionModeState, SessionUpdate, SetSessionConfigOptionRequest,
    SetSessionConfigOptionResponse, SetSessionModeRequest, SetSessionModeResponse,
};
use pier_acp::RequestCx;
use pier_acp::error::invalid_params;
use pier_engine::Mode;
use serde_json::Value;

use crate::{AcpAgent, SessionEntry, lock, to_value};

const MODE: &str = "mode";
const MODEL: &str = "model";

impl AcpAgent {
    pub(crate) fn modes(&self, entry: &SessionEntry) -> SessionModeState {
        let available = Mode::ALL
            .iter()
            .map(|m| SessionMode::new(m.id(), m.name()).description(m.description().to_owned()))
            .collect();
        SessionModeState::new(entry.session.mode().id(), available)
    }

    pub(crate) fn config_options(&self, entry: &SessionEntry) -> Vec<SessionConfigOption> {
        let modes: Vec<SessionConfigSelectOption> = Mode::ALL
            .iter()
            .map(|m| SessionConfigSelectOption::new(m.id(), m.name()).description(m.description().to_owned()))
            .collect();
        let mut options = vec![
            SessionConfigOption::select(MODE, "Mode", entry.session.mode().id(), modes)
                .description("What the agent may do without asking".to_owned())
                .category(SessionConfigOptionCategory::Mode),
        ];
        let models = &self.options.models;
        if models.len() > 1 {
            let current = lock(&entry.model)
                .clone()
                .or_else(|| self.options.default_model.clone())
                .unwrap_or_else(|| models[0].name.clone());
            let choices: Vec<SessionConfigSelectOption> = models
                .iter()
                .map(|m| {
                    SessionConfigSelectOption::new(m.name.clone(), m.name.clone()).description(m.provider.describe())
                })
                .collect();
            options.push(
                SessionConfigOption::select(MODEL, "Model", current, choices)
                    .category(SessionConfigOptionCategory::Model),
            );
        }
        options
    }

    pub(crate) async fn set_mode(self: Arc<Self>, cx: RequestCx, req: SetSessionModeRequest) -> Result<Value, Error> {
        self.require_initialized()?;
        let id = req.session_id.0.to_string();
        let entry = self.entry(&id)?;
        let mode: Mode = req.mode_id.0.parse().map_err(invalid_params)?;
        entry.session.set_mode(mode);
        tracing::info!(session = %id, mode = mode.id(), "mode set");
        Self::send_update(
            &cx.conn,
            &id,
            SessionUpdate::ConfigOptionUpdate(ConfigOptionUpdate::new(self.config_options(&entry))),
        )
        .await;
        to_value(&SetSessionModeResponse::new())
    }

    pub(crate) async fn set_config_option(
        self: Arc<Self>,
        cx: RequestCx,
        req: SetSessionConfigOptionRequest,
    ) -> Result<Value, Error> {
        self.require_initialized()?;
        let id = req.session_id.0.to_string();
        let entry = self.entry(&id)?;
        let value = req
            .value
            .as_value_id()
            .map(|v| v.0.to_string())
            .ok_or_else(|| invalid_params("pier's config options are selects; send a value id"))?;
        match req.config_id.0.as_ref() {
            MODE => {
                let mode: Mode = value.parse().map_err(invalid_params)?;
                entry.session.set_mode(mode);
                Self::send_update(&cx.conn, &id, SessionUpdate::CurrentModeUpdate(CurrentModeUpdate::new(mode.id())))
                    .await;
            }
            MODEL if self.options.models.len() > 1 => {
                let model = self.options.models.iter().find(|m| m.name == value).ok_or_else(|| {
                    let known: Vec<&str> = self.options.models.iter().map(|m| m.name.as_str()).collect();
                    invalid_params(format!("unknown model `{value}`; expected one of {}", known.join(", ")))
                })?;
                entry.session.set_model(&model.name, model.provider.clone());
                *lock(&entry.model) = Some(model.name.clone());
            }
            other => {
                return Err(invalid_params(format!(
                    "unknown config option `{other}`; see the session's configOptions"
                )));
            }
        }
        tracing::info!(session = %id, option = %req.config_id.0, %value, "config option set");
        to_value(&SetSessionConfigOptionResponse::new(self.config_options(&entry)))
    }
}
