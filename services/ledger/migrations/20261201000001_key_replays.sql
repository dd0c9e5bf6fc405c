-- How often each key's saved reply was replayed, and when last. Besides telling an operator
-- which clients retry, the update is what makes a replay wait for the synchronous standby:
-- a transaction that writes nothing commits without waiting for it (store.rs, `replicated`).
--
-- ALTER TABLE takes the table's strongest lock. During a rolling deploy other ledger
-- instances hold charges open (across the processor call); waiting behind them would queue
-- every new charge behind this statement. Give up after 2 s instead: the ledger retries the
-- migration (store.rs, `KeyStore::connect`). Adding a column with a constant default
-- rewrites nothing, so once the lock is had the statement is instant.
SET LOCAL lock_timeout = '2s';

ALTER TABLE idempotency_keys
    ADD COLUMN replays     BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN replayed_at TIMESTAMPTZ;
