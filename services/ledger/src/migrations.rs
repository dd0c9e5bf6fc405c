//! The key store's schema: the SQL files under `migrations/`, compiled into the binary and
//! applied at start-up (sqlx's migrator, its `_sqlx_migrations` table and checksums).
//!
//! The list is written out rather than read by `sqlx::migrate!`: that macro is the only
//! reason the workspace would build sqlx's proc-macro crate, and with it a second copy of
//! sqlx, tokio and rustls for the build host (about a minute of every clean build). The
//! checksum of each file is computed by sqlx from the same bytes the macro would embed, so
//! databases migrated by earlier builds validate unchanged; a test checks that the list
//! and the directory agree.

use std::borrow::Cow;

use sqlx::{
    SqlSafeStr,
    migrate::{Migration, MigrationType, Migrator},
};

/// Every migration file: its name (version and description, as sqlx derives them from
/// the file name) and its SQL. A new file goes at the end.
const FILES: [(&str, &str); 5] = [
    (
        "20261129000001_ledger.sql",
        include_str!("../migrations/20261129000001_ledger.sql"),
    ),
    (
        "20261201000001_key_replays.sql",
        include_str!("../migrations/20261201000001_key_replays.sql"),
    ),
    (
        "20261202000001_atomic_phases.sql",
        include_str!("../migrations/20261202000001_atomic_phases.sql"),
    ),
    (
        "20261202000002_abandoned_keys_index.sql",
        include_str!("../migrations/20261202000002_abandoned_keys_index.sql"),
    ),
    (
        "20261202000003_account_owners.sql",
        include_str!("../migrations/20261202000003_account_owners.sql"),
    ),
];

/// The migrator over [`FILES`], as `sqlx::migrate!("./migrations")` would build it: the
/// version and description from the file name (`<version>_<words_with_underscores>.sql`),
/// outside a transaction when the file starts with `-- no-transaction`.
pub(crate) fn migrator() -> Migrator {
    Migrator::with_migrations(
        FILES
            .iter()
            .map(|&(file, sql)| {
                let (version, description) = parse_name(file);
                Migration::new(
                    version,
                    Cow::Owned(description),
                    MigrationType::Simple,
                    sql.into_sql_str(),
                    sql.starts_with("-- no-transaction"),
                )
            })
            .collect(),
    )
}

/// `20261129000001_ledger_things.sql` → (20261129000001, "ledger things").
fn parse_name(file: &str) -> (i64, String) {
    let stem = file.strip_suffix(".sql").unwrap_or(file);
    let (version, words) = stem.split_once('_').unwrap_or((stem, ""));
    let version = version
        .parse()
        .unwrap_or_else(|_| panic!("migration {file}: the name starts with its version"));
    (version, words.replace('_', " "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The list names every file of the directory once, in order, with the bytes on disk
    /// (a file added without a line here would never be applied).
    #[test]
    fn the_list_is_the_directory() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .expect("migrations/")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        on_disk.sort();
        let listed: Vec<&str> = FILES.iter().map(|(file, _)| *file).collect();
        assert_eq!(listed, on_disk);
        for (file, sql) in FILES {
            assert_eq!(
                std::fs::read_to_string(format!("{dir}/{file}")).expect("readable"),
                sql
            );
        }
    }

    #[test]
    fn versions_descriptions_and_transactions_as_sqlx_derives_them() {
        let migrator = migrator();
        let all: Vec<_> = migrator.iter().collect();
        assert_eq!(all.len(), FILES.len());
        assert_eq!(all[0].version, 20261129000001);
        assert_eq!(all[0].description, "ledger");
        assert_eq!(all[1].description, "key replays");
        assert!(!all[2].no_tx);
        assert!(
            all[3].no_tx,
            "CREATE INDEX CONCURRENTLY runs outside a transaction"
        );
        assert!(all.windows(2).all(|w| w[0].version < w[1].version));
    }
}
