//! The CLI side of the socket: connect, send one request, read the answers.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use rustix::net::sockopt::socket_peercred;
use rustix::process::geteuid;

use crate::protocol::{Envelope, Request, Response, MAX_MESSAGE_BYTES, PROTOCOL_VERSION};

/// Why the daemon could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the gpuguard daemon at {path}: {source} (is it running? `systemctl status gpuguard`)")]
    Unreachable {
        path: String,
        source: std::io::Error,
    },
    #[error("the socket at {path} is served by uid {uid}, neither root nor you: not the gpuguard daemon, its answers are not trusted")]
    NotTheDaemon { path: String, uid: u32 },
    #[error("the daemon closed the connection without an answer")]
    NoAnswer,
    #[error("bad answer from the daemon: {0}")]
    Bad(String),
}

pub struct Connection {
    reader: BufReader<UnixStream>,
}

fn line(request: Request) -> Vec<u8> {
    let mut line = serde_json::to_vec(&Envelope {
        version: PROTOCOL_VERSION,
        request,
    })
    .expect("serialisable");
    line.push(b'\n');
    line
}

impl Connection {
    pub fn open(path: &Path, request: Request) -> Result<Connection, ClientError> {
        let unreachable = |source| ClientError::Unreachable {
            path: path.display().to_string(),
            source,
        };
        let mut stream = UnixStream::connect(path).map_err(unreachable)?;
        // A socket another user made where the daemon's is looked for (a writable state
        // directory, a path given on the command line) could answer with anything: the daemon
        // runs as root (or as you, started by hand).
        let served_by = socket_peercred(&stream)
            .map_err(|e| unreachable(e.into()))?
            .uid
            .as_raw();
        if served_by != 0 && served_by != geteuid().as_raw() {
            return Err(ClientError::NotTheDaemon {
                path: path.display().to_string(),
                uid: served_by,
            });
        }
        stream.write_all(&line(request)).map_err(unreachable)?;
        Ok(Connection {
            reader: BufReader::new(stream),
        })
    }

    /// Another request on the same connection (a permit session).
    pub fn send(&mut self, request: Request) -> Result<(), ClientError> {
        self.reader
            .get_mut()
            .write_all(&line(request))
            .map_err(|e| ClientError::Bad(e.to_string()))
    }

    /// A second handle on the connection, to read answers on another thread.
    pub fn try_clone(&self) -> std::io::Result<Connection> {
        Ok(Connection {
            reader: BufReader::new(self.reader.get_ref().try_clone()?),
        })
    }

    /// The next answer.
    pub fn receive(&mut self) -> Result<Response, ClientError> {
        let mut line = String::new();
        let n = (&mut self.reader)
            .take(MAX_MESSAGE_BYTES as u64 + 1)
            .read_line(&mut line)
            .map_err(|e| ClientError::Bad(e.to_string()))?;
        if n == 0 {
            return Err(ClientError::NoAnswer);
        }
        serde_json::from_str(&line).map_err(|e| ClientError::Bad(e.to_string()))
    }
}

/// One request, one answer.
pub fn ask(path: &Path, request: Request) -> Result<Response, ClientError> {
    Connection::open(path, request)?.receive()
}
