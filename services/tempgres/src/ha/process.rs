//! The processes of a formation, outside `pg_autoctl`: signals sent with the external
//! `kill`, the postmaster found from its data directory, the guardian shell that stops
//! everything and removes the directory when the formation goes, and commands printed
//! for a reader to paste into a shell.

use std::{
    fs,
    os::unix::process::CommandExt,
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
};

use crate::{error::Error, host::read_to_string};

/// `word` as one shell word: as it is when nothing in it is special to a shell, else in
/// single quotes.
pub(super) fn shell_quoted(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/_.,:=@%+-".contains(c));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// Sends `signal` to process `pid` (the external `kill`, as for [`signal_group`]).
pub(super) fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// Sends `signal` to process group `pgid` (procps' `kill`, which takes `-- -pgid`).
pub(super) fn signal_group(pgid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), "--", &format!("-{pgid}")])
        .stderr(Stdio::null())
        .status();
}

/// The pid of the Postgres server running on `pgdata`, if one is: the first line of its
/// `postmaster.pid`, checked against the process's command line (a stale file may name a
/// pid since reused).
pub(super) fn postmaster_of(pgdata: &Path) -> Option<u32> {
    let pid: u32 = read_to_string(&pgdata.join("postmaster.pid"))
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let cmdline = String::from_utf8_lossy(&cmdline);
    cmdline.contains(&*pgdata.to_string_lossy()).then_some(pid)
}

/// Stops the formation and removes its directory once our end of its pipe closes — when
/// the [`HaFormation`] is dropped, or this process dies: freezes every keeper with its
/// helpers (the process groups of its `*.pgid` files, each checked to still be a
/// `pg_autoctl`, since a group id can be reused), so none restarts a server; asks every
/// server still running on one of its data directories for an immediate shutdown
/// (SIGQUIT, which also releases its shared memory), then kills what is left. `env kill`:
/// the shell's own `kill` may not take `--`.
const GUARDIAN: &str = r#"
trap '' INT TERM
dir="$1"
cat >/dev/null
groups=""
for file in "$dir"/*.pgid; do
  [ -f "$file" ] || continue
  pgid=$(cat "$file")
  if tr '\0' ' ' <"/proc/$pgid/cmdline" 2>/dev/null | grep -q pg_autoctl; then
    env kill -STOP -- "-$pgid" 2>/dev/null
    groups="$groups $pgid"
  fi
done
servers=""
for pgdata in "$dir"/monitor "$dir"/node1 "$dir"/node2; do
  pid=$(head -n 1 "$pgdata/postmaster.pid" 2>/dev/null)
  if [ -n "$pid" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$pgdata"; then
    # In a keeper's group, so stopped with it above: let it run to shut down.
    env kill -CONT "$pid" 2>/dev/null; env kill -QUIT "$pid" 2>/dev/null
    servers="$servers $pid"
  fi
done
for attempt in 1 2 3 4 5 6 7 8 9 10; do
  alive=""
  for pid in $servers; do [ -d "/proc/$pid" ] && alive="$alive $pid"; done
  [ -z "$alive" ] && break
  sleep 0.2
done
for pgid in $groups; do env kill -KILL -- "-$pgid" 2>/dev/null; done
for pid in $servers; do
  [ -d "/proc/$pid" ] && { pkill -KILL -P "$pid"; env kill -KILL "$pid"; } 2>/dev/null
done
# A process that was dying may still write a file as the directory goes: try again.
for attempt in 1 2 3 4 5; do
  sleep 0.2
  rm -rf "$dir" 2>/dev/null && break
done
"#;

pub(super) fn guardian(
    dir: &Path,
    run_as: Option<(u32, u32)>,
    path: &str,
) -> Result<(Child, ChildStdin), Error> {
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(GUARDIAN)
        .arg("guardian")
        .arg(dir)
        .env("PATH", path)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // A group of its own: whoever kills this process's group (a CI timeout) must not
        // take the guardian with it, or the formation would outlive us.
        .process_group(0);
    if let Some((uid, gid)) = run_as {
        command.uid(uid).gid(gid);
    }
    let mut child = command.spawn().map_err(|source| Error::Spawn {
        program: "sh".into(),
        source,
    })?;
    let pipe = child
        .stdin
        .take()
        .ok_or_else(|| Error::Io(std::io::Error::other("the guardian has no stdin")))?;
    Ok((child, pipe))
}
