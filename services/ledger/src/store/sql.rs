//! Every statement the key store sends, as text: each is one transaction of its own (an
//! atomic phase, or one look at a key), and the module docs of [`super`] say which
//! transition each makes.

/// Phase 1, and every later look at a key: one statement. First the account: created
/// for the caller (`$7`) with nothing charged if it is new, else locked (the row, no new
/// version) and, only if another caller owns it, returned — and then nothing else
/// happens: no row comes back, and the request is refused before the key is looked at, so
/// one caller can neither claim a key on another's account nor be replayed its reply.
/// Then the key: a new one is inserted as started under our lease; an existing one is
/// returned as it is, except that a started key whose lease passed is taken over (if the
/// parameters match) and a settled one has its replay counted (if they match: the write
/// makes the commit wait for the synchronous standby). `inserted` tells a fresh claim from
/// a conflict.
pub const CLAIM: &str = "\
WITH account AS ( \
    INSERT INTO accounts (account_id, owner, balance_cents, charges) VALUES ($1, $7, 0, 0) \
    ON CONFLICT (account_id) DO UPDATE SET owner = accounts.owner \
    WHERE accounts.owner <> EXCLUDED.owner \
    RETURNING owner) \
INSERT INTO idempotency_keys AS k \
    (account_id, idempotency_key, request_amount_cents, state, lease_owner, lease_expires_at, processor_key) \
SELECT $1, $2, $3, 'started', $4, now() + make_interval(secs => $5), $6 \
WHERE NOT EXISTS (SELECT 1 FROM account WHERE account.owner <> $7) \
ON CONFLICT (account_id, idempotency_key) DO UPDATE SET \
    lease_owner = CASE WHEN k.state = 'started' AND k.lease_expires_at <= now() \
        AND k.request_amount_cents = EXCLUDED.request_amount_cents \
        THEN EXCLUDED.lease_owner ELSE k.lease_owner END, \
    lease_expires_at = CASE WHEN k.state = 'started' AND k.lease_expires_at <= now() \
        AND k.request_amount_cents = EXCLUDED.request_amount_cents \
        THEN EXCLUDED.lease_expires_at ELSE k.lease_expires_at END, \
    takeovers = k.takeovers + CASE WHEN k.state = 'started' AND k.lease_expires_at <= now() \
        AND k.request_amount_cents = EXCLUDED.request_amount_cents THEN 1 ELSE 0 END, \
    replays = k.replays + CASE WHEN k.state <> 'started' \
        AND k.request_amount_cents = EXCLUDED.request_amount_cents THEN 1 ELSE 0 END, \
    replayed_at = CASE WHEN k.state <> 'started' \
        AND k.request_amount_cents = EXCLUDED.request_amount_cents THEN now() ELSE k.replayed_at END \
RETURNING (xmax = 0) AS inserted, k.state, k.request_amount_cents, k.charge_id, k.balance_cents, \
    k.lease_owner, k.processor_key, k.error_code, k.error_message";

/// Phase 2: the effect and the reply, in one statement, only while the key is ours (its
/// row locked first, so a concurrent take-over waits for it or wins before it).
pub const FINISH: &str = "\
WITH owned AS ( \
    SELECT request_amount_cents FROM idempotency_keys \
    WHERE account_id = $1 AND idempotency_key = $2 AND state = 'started' AND lease_owner = $3 \
    FOR UPDATE), \
account AS ( \
    INSERT INTO accounts (account_id, balance_cents, charges) \
    SELECT $1, request_amount_cents, 1 FROM owned \
    ON CONFLICT (account_id) DO UPDATE \
    SET balance_cents = accounts.balance_cents + EXCLUDED.balance_cents, \
        charges = accounts.charges + 1, updated_at = now() \
    RETURNING balance_cents), \
charge AS ( \
    INSERT INTO charges (charge_id, account_id, amount_cents, balance_cents, idempotency_key) \
    SELECT $4, $1, owned.request_amount_cents, account.balance_cents, $2 FROM owned, account \
    RETURNING charge_id, balance_cents) \
UPDATE idempotency_keys SET state = 'finished', charge_id = charge.charge_id, \
    balance_cents = charge.balance_cents, lease_owner = NULL, lease_expires_at = NULL, \
    finished_at = now() \
FROM charge WHERE idempotency_keys.account_id = $1 AND idempotency_keys.idempotency_key = $2 \
RETURNING charge.balance_cents";

/// Phase 2 when the processor refused for good: the error saved, while the key is ours.
pub const FAIL: &str = "\
UPDATE idempotency_keys SET state = 'failed', error_code = $4, error_message = $5, \
    lease_owner = NULL, lease_expires_at = NULL, finished_at = now() \
WHERE account_id = $1 AND idempotency_key = $2 AND state = 'started' AND lease_owner = $3";

/// The owner, while the processor works: its lease goes on (false: the key was taken).
pub const RENEW: &str = "\
UPDATE idempotency_keys SET lease_expires_at = now() + make_interval(secs => $4) \
WHERE account_id = $1 AND idempotency_key = $2 AND state = 'started' AND lease_owner = $3";

/// After a transient failure the caller was told of: the lease ends now and has no owner,
/// so the next request resumes at once, and the completer knows the caller was answered
/// (it is the caller's to retry; see [`TAKE_OVER`]).
pub const RELEASE: &str = "\
UPDATE idempotency_keys SET lease_expires_at = now(), lease_owner = NULL \
WHERE account_id = $1 AND idempotency_key = $2 AND state = 'started' AND lease_owner = $3";

/// A look at a key another instance runs, without writing (the waiting request's poll).
pub(super) const LOOK: &str = "\
SELECT state, lease_expires_at <= now() AS expired FROM idempotency_keys \
WHERE account_id = $1 AND idempotency_key = $2";

/// The completer: keys nobody came back for, oldest first, taken over. A key whose owner
/// vanished holding it (its lease passed with an owner: a crash, a freeze, a lost
/// database) is due [`ABANDONED_AFTER`](super::ABANDONED_AFTER) after its lease passed. A key its owner released
/// after a transient failure — the caller was answered, and may retry — is due only after
/// [`RELEASED_AFTER`](super::RELEASED_AFTER), doubled for every earlier take-over (at most 2⁸ times): in an
/// outage of the processor the completer adds a trickle of calls, not a retry storm; yet
/// a charge whose answer was lost after the processor made it is finished in the end.
pub const TAKE_OVER: &str = "\
UPDATE idempotency_keys AS k SET lease_owner = $1, \
    lease_expires_at = now() + make_interval(secs => $2), takeovers = k.takeovers + 1 \
FROM (SELECT account_id, idempotency_key FROM idempotency_keys \
      WHERE state = 'started' AND ( \
          (lease_owner IS NOT NULL AND lease_expires_at <= now() - make_interval(secs => $3)) \
       OR (lease_owner IS NULL AND lease_expires_at <= now() \
              - make_interval(secs => $5 * power(2, least(takeovers, 8))))) \
      ORDER BY lease_expires_at LIMIT $4 FOR UPDATE SKIP LOCKED) AS due \
WHERE k.account_id = due.account_id AND k.idempotency_key = due.idempotency_key \
RETURNING k.account_id, k.idempotency_key, k.request_amount_cents, k.processor_key";

/// After an outcome committed, when the ledger confirms standby copies
/// ([`StoreOptions::standby_copy`](super::StoreOptions::standby_copy)): how far this
/// server has flushed its WAL — past that commit, which flushed before it returned — and
/// how far its most advanced physical standby has (NULL while none is connected), as byte
/// positions. A logical subscriber is no failover candidate, so its walsender (the one
/// holding a logical slot) does not count.
pub(super) const COPIED: &str = "\
SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::int8 AS flushed, \
    ((SELECT max(r.flush_lsn) FROM pg_stat_replication AS r WHERE NOT EXISTS ( \
        SELECT 1 FROM pg_replication_slots AS s \
        WHERE s.active_pid = r.pid AND s.slot_type = 'logical')) - '0/0'::pg_lsn)::int8 AS copied";

/// Whether this session may read where its server's standbys stand (`pg_stat_replication`
/// hides the positions from a role that is neither a superuser nor in `pg_read_all_stats`):
/// asked once at start-up when the ledger confirms standby copies.
pub(super) const MAY_READ_STANDBYS: &str =
    "SELECT pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER')";
