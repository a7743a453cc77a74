//! The process's stdin and stdout as async streams.
//!
//! When they are pipes (how every ACP client runs an agent), they are driven by
//! the reactor directly, non-blocking; otherwise (a terminal, a file) through
//! tokio's blocking-thread stdio. The difference is large: tokio's stdio hands
//! every read and write to a blocking thread.

use std::os::fd::AsFd;

use tokio::io::{AsyncRead, AsyncWrite};

pub type Reader = Box<dyn AsyncRead + Unpin + Send>;
pub type Writer = Box<dyn AsyncWrite + Unpin + Send>;

/// stdin and stdout for a connection.
pub fn streams() -> (Reader, Writer) {
    let reader: Reader = match std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map(std::fs::File::from)
        .and_then(tokio::net::unix::pipe::Receiver::from_file)
    {
        Ok(pipe) => Box::new(pipe),
        Err(_) => Box::new(tokio::io::stdin()),
    };
    let writer: Writer = match std::io::stdout()
        .as_fd()
        .try_clone_to_owned()
        .map(std::fs::File::from)
        .and_then(tokio::net::unix::pipe::Sender::from_file)
    {
        Ok(pipe) => Box::new(pipe),
        Err(_) => Box::new(tokio::io::stdout()),
    };
    (reader, writer)
}
