//! The admin token: read from `server.admin_token_file`, or from `<data-dir>/admin-token`,
//! which is created (mode 0600, 32 random bytes as 64 hex digits) when absent.

use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The token file's name inside the data directory.
pub const TOKEN_FILE: &str = "admin-token";

/// Random bytes in a created token (it is written as twice as many hex digits).
pub const TOKEN_BYTES: usize = 32;

/// Why the admin token could not be had. Each names the file (or directory) concerned.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The configured `server.admin_token_file` cannot be read (missing, unreadable).
    #[error("admin token file {} (server.admin_token_file) cannot be read: {source}", path.display())]
    ReadConfigured {
        /// The configured file.
        path: PathBuf,
        /// What reading it reported.
        #[source]
        source: io::Error,
    },
    /// A token file holds nothing but whitespace.
    #[error("admin token file {} is empty; write the token into it", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// A token file holds characters a `Bearer` header cannot carry.
    #[error(
        "admin token file {} holds characters other than printable ASCII (spaces, control \
         characters or non-ASCII); a token is one word of printable ASCII",
        path.display()
    )]
    NotPrintable {
        /// The file.
        path: PathBuf,
    },
    /// The token file in the data directory exists but cannot be read.
    #[error("admin token file {} cannot be read: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What reading it reported.
        #[source]
        source: io::Error,
    },
    /// The data directory cannot be created.
    #[error("data directory {} cannot be created: {source}", path.display())]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// What creating it reported.
        #[source]
        source: io::Error,
    },
    /// The token file cannot be written.
    #[error("admin token file {} cannot be written: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// What writing it reported.
        #[source]
        source: io::Error,
    },
    /// No random bytes for a new token.
    #[error("cannot read random bytes from /dev/urandom for a new admin token: {source}")]
    Random {
        /// What reading reported.
        #[source]
        source: io::Error,
    },
}

impl TokenError {
    /// A short stable name of the failure, for metrics and event reasons.
    pub fn metric_label(&self) -> &'static str {
        match self {
            TokenError::ReadConfigured { .. } => "read_configured",
            TokenError::Empty { .. } => "empty",
            TokenError::NotPrintable { .. } => "not_printable",
            TokenError::Read { .. } => "read",
            TokenError::CreateDir { .. } => "create_dir",
            TokenError::Write { .. } => "write",
            TokenError::Random { .. } => "random",
        }
    }
}

/// Where standalone keeps its token: `<data-dir>/admin-token`. The CLI reads it from there.
pub fn token_path(data_dir: &Path) -> PathBuf {
    data_dir.join(TOKEN_FILE)
}

/// The admin token.
///
/// - `configured` (`server.admin_token_file`) is read and trimmed; a missing, unreadable or
///   empty file is an error naming it. Nothing is created.
/// - Otherwise `<data-dir>/admin-token` is read when it exists. When it does not, the data
///   directory is created (mode 0700) if missing and the file is created with mode 0600 holding
///   a random token (32 bytes from `/dev/urandom`, 64 lowercase hex digits). A file left empty
///   (a crash before its first write) is replaced the same way.
///
/// NB: the new file is written completely under a temporary name and then hard-linked into
/// place, so a reader never sees a half-written token, and two servers starting at once on one
/// data directory agree on one token.
pub fn load_or_create_token(
    configured: Option<&Path>,
    data_dir: &Path,
) -> Result<String, TokenError> {
    if let Some(path) = configured {
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::ReadConfigured {
            path: path.to_path_buf(),
            source,
        })?;
        return check_token(path, &text);
    }
    let path = token_path(data_dir);
    match std::fs::read_to_string(&path) {
        Ok(text) if !text.trim().is_empty() => {
            warn_if_loose(&path);
            return check_token(&path, &text);
        }
        Ok(_) => {} // empty: replace it below
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(TokenError::Read { path, source }),
    }
    create_token(data_dir, &path)
}

/// Trims `text` and checks that it is one word of printable ASCII.
fn check_token(path: &Path, text: &str) -> Result<String, TokenError> {
    let token = text.trim();
    if token.is_empty() {
        return Err(TokenError::Empty {
            path: path.to_path_buf(),
        });
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TokenError::NotPrintable {
            path: path.to_path_buf(),
        });
    }
    Ok(token.to_string())
}

fn warn_if_loose(path: &Path) {
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                file = %path.display(),
                mode = format_args!("{mode:04o}"),
                "the admin token file is readable by others than its owner; chmod 600 it"
            );
        }
    }
}

fn random_token() -> Result<String, TokenError> {
    let mut bytes = [0u8; TOKEN_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|source| TokenError::Random { source })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn create_token(data_dir: &Path, path: &Path) -> Result<String, TokenError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(data_dir)
        .map_err(|source| TokenError::CreateDir {
            path: data_dir.to_path_buf(),
            source,
        })?;
    let token = random_token()?;
    let tmp = data_dir.join(format!(".{TOKEN_FILE}.{}.tmp", std::process::id()));
    let write_err = |source| TokenError::Write {
        path: path.to_path_buf(),
        source,
    };
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(format!("{token}\n").as_bytes())?;
            f.sync_all()
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(write_err(e));
    }
    let placed = match std::fs::hard_link(&tmp, path) {
        Ok(()) => Ok(token),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            // Another start won the race, or the file is the empty one found before.
            match std::fs::read_to_string(path) {
                Ok(text) if !text.trim().is_empty() => check_token(path, &text),
                _ => std::fs::rename(&tmp, path)
                    .map(|()| token)
                    .map_err(write_err),
            }
        }
        Err(e) => Err(write_err(e)),
    };
    let _ = std::fs::remove_file(&tmp);
    if placed.is_ok()
        && let Ok(dir) = std::fs::File::open(data_dir)
    {
        let _ = dir.sync_all();
    }
    placed
}
