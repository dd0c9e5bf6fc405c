-- How often each key's saved reply was replayed, and when last. Besides telling an operator
-- which clients retry, the update is what makes a replay wait for the synchronous standby:
-- a transaction that writes nothing commits without waiting for it (store.rs, `replicated`).
ALTER TABLE idempotency_keys
    ADD COLUMN replays     BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN replayed_at TIMESTAMPTZ;
