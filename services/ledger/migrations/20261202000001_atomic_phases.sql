-- Atomic phases (store.rs): a key is claimed and committed before the processor is called,
-- and finished (or failed) by a second statement; the row says how far the charge got.
--
-- Online with the previous ledger version on the same database: its rows are written
-- whole in one transaction, so the default 'finished' is true of every one of them, and
-- of every row it writes while both versions run. A previous-version ledger that meets a
-- key a new one has only started (or failed) finds no saved reply and answers INTERNAL
-- without charging; it never charges a key it did not claim. Roll the new version out,
-- then retire the old (docs/reliability.md).
--
-- ALTER TABLE takes the table's strongest lock; give up after 2 s rather than queue
-- every charge behind it (the ledger retries the migration). The new columns have
-- constant defaults or none: nothing is rewritten.
SET LOCAL lock_timeout = '2s';

ALTER TABLE idempotency_keys
    ADD COLUMN state            TEXT NOT NULL DEFAULT 'finished',
    ADD COLUMN lease_owner      UUID,
    ADD COLUMN lease_expires_at TIMESTAMPTZ,
    ADD COLUMN processor_key    TEXT,
    ADD COLUMN error_code       INTEGER,
    ADD COLUMN error_message    TEXT,
    ADD COLUMN takeovers        INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN finished_at      TIMESTAMPTZ;

-- Checked for every row written from now on; the rows already there are all 'finished'
-- (the default), so validating them would only hold a lock while it reads the table.
ALTER TABLE idempotency_keys
    ADD CONSTRAINT idempotency_keys_state
    CHECK (state IN ('started', 'finished', 'failed')) NOT VALID;

-- The simulated payment processor's own record (processor.rs): what a provider keeps on
-- its side, here in the ledger's database for want of a second system. One row per
-- processor key, with the parameters it was first charged with and how often it was
-- called; it outlives a crash of the ledger, as a provider's record would.
CREATE TABLE processor_charges (
    processor_key TEXT PRIMARY KEY,
    amount_cents  BIGINT NOT NULL,
    calls         BIGINT NOT NULL DEFAULT 1,
    first_call_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_call_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX processor_charges_first_call_at ON processor_charges (first_call_at);
