-- no-transaction
-- The completer's look for started keys whose lease passed (store.rs, TAKE_OVER): a
-- partial index, small (only started keys are in it), built without blocking writes.
CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_keys_abandoned
    ON idempotency_keys (lease_expires_at) WHERE state = 'started';
