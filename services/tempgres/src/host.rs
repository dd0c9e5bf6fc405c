//! What the clusters need from this machine: the server binaries, wherever the installation
//! put them ([`find_bindir`]), an unprivileged user to run them as when we are root, and free
//! ports.

use std::{
    collections::BTreeSet,
    fs,
    io::Read,
    net::TcpListener,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, PoisonError},
};

use crate::error::Error;

/// The programs a cluster needs, all from one installation.
const PROGRAMS: [&str; 3] = ["initdb", "postgres", "pg_ctl"];

/// Where the server binaries are: the first directory holding all of [`PROGRAMS`] among
/// PATH's entries, `pg_config --bindir`, and the newest `/usr/lib/postgresql/*/bin`.
pub fn find_bindir() -> Result<PathBuf, Error> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let pg_config = find_in_path(&path, "pg_config").and_then(|pg_config| {
        let output = Command::new(pg_config).arg("--bindir").output().ok()?;
        output
            .status
            .success()
            .then(|| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()))
    });
    find_bindir_in(&path, pg_config, Path::new("/usr/lib/postgresql"))
}

/// [`find_bindir`] over given places, so it can be tested without touching the machine.
pub fn find_bindir_in(
    path: &std::ffi::OsStr,
    pg_config_bindir: Option<PathBuf>,
    versions_root: &Path,
) -> Result<PathBuf, Error> {
    let complete = |dir: &Path| PROGRAMS.iter().all(|p| is_executable(&dir.join(p)));
    if let Some(dir) = std::env::split_paths(path).find(|dir| complete(dir)) {
        return Ok(dir);
    }
    if let Some(dir) = pg_config_bindir.filter(|dir| complete(dir)) {
        return Ok(dir);
    }
    let mut versions: Vec<(Vec<u32>, PathBuf)> = fs::read_dir(versions_root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let version = name
                .split('.')
                .map(str::parse::<u32>)
                .collect::<Result<Vec<_>, _>>()
                .ok()?;
            let bin = entry.path().join("bin");
            complete(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, dir)| dir).ok_or(Error::NotFound)
}

pub(crate) fn find_in_path(path: &std::ffi::OsStr, program: &str) -> Option<PathBuf> {
    std::env::split_paths(path)
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `None` when this process may run Postgres itself; the uid and gid to run it as when we
/// are root.
pub(crate) fn unprivileged_user() -> Result<Option<(u32, u32)>, Error> {
    if fs::metadata("/proc/self")?.uid() != 0 {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd")?;
    for wanted in ["postgres", "nobody"] {
        for line in passwd.lines() {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() > 3
                && fields[0] == wanted
                && let (Ok(uid), Ok(gid)) = (fields[2].parse(), fields[3].parse())
            {
                return Ok(Some((uid, gid)));
            }
        }
    }
    Err(Error::Io(std::io::Error::other(
        "running as root and neither a postgres nor a nobody user exists to run PostgreSQL as",
    )))
}

/// Where ports for the servers are picked: below the kernel's range for outgoing
/// connections (32768–60999 on Linux by default), so that no connection's local port can
/// take one between the pick and the server's bind.
const PORTS: std::ops::Range<u16> = 20_000..32_000;

/// Ports this process has handed out: never handed out twice, though a server may not have
/// bound its own yet (`pg_autoctl` stops and starts a node's Postgres while it is created,
/// and the kernel once gave the second node the first one's port, free for that moment).
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A port on 127.0.0.1 for a server to listen on: free now, from [`PORTS`], and not
/// handed out before by this process.
pub(crate) fn free_port() -> Result<u16, Error> {
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
    for _ in 0..1_000 {
        let port = rand::random_range(PORTS);
        if !handed_out.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.insert(port);
            return Ok(port);
        }
    }
    Err(Error::Io(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free port on 127.0.0.1 in {PORTS:?}"),
    )))
}

pub(crate) fn read_to_string(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut file) = fs::File::open(path) {
        let _ = file.read_to_string(&mut text);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_binaries_on_path_then_pg_config_then_the_newest_version() {
        let root = tempfile::tempdir().expect("tempdir");
        let make = |dir: &Path| {
            fs::create_dir_all(dir).expect("mkdir");
            for program in PROGRAMS {
                let file = dir.join(program);
                fs::write(&file, "#!/bin/sh\n").expect("write");
                use std::os::unix::fs::PermissionsExt;
                fs::set_permissions(&file, fs::Permissions::from_mode(0o755)).expect("chmod");
            }
        };
        let versions = root.path().join("lib");
        make(&versions.join("9.6/bin"));
        make(&versions.join("15/bin"));
        make(&versions.join("13/bin"));
        fs::create_dir_all(versions.join("16/bin")).expect("an incomplete installation");
        let empty = std::ffi::OsString::from("/nonexistent:/also/not");

        assert_eq!(
            find_bindir_in(&empty, None, &versions).expect("found"),
            versions.join("15/bin"),
            "the newest complete version"
        );
        let configured = root.path().join("configured");
        make(&configured);
        assert_eq!(
            find_bindir_in(&empty, Some(configured.clone()), &versions).expect("found"),
            configured
        );
        let on_path = root.path().join("on-path");
        make(&on_path);
        let path = std::env::join_paths(["/nonexistent".into(), on_path.clone()]).expect("path");
        assert_eq!(
            find_bindir_in(&path, Some(configured), &versions).expect("found"),
            on_path
        );
        let error = find_bindir_in(&empty, None, &root.path().join("none")).expect_err("none");
        let message = error.to_string();
        assert!(message.contains("not found"), "{message}");
        assert!(message.contains("apt-get install postgresql"), "{message}");
        assert!(message.contains("DATABASE_URL"), "{message}");
    }
}
