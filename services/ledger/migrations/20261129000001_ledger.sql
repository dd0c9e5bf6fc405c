-- Accounts come into being with their first charge.
CREATE TABLE accounts (
    account_id    TEXT PRIMARY KEY,
    balance_cents BIGINT NOT NULL,
    charges       BIGINT NOT NULL,
    updated_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- One row per committed charge: the effect.
CREATE TABLE charges (
    charge_id       UUID PRIMARY KEY,
    account_id      TEXT NOT NULL REFERENCES accounts (account_id),
    amount_cents    BIGINT NOT NULL CHECK (amount_cents > 0),
    balance_cents   BIGINT NOT NULL,
    idempotency_key TEXT NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- One row per idempotency key, scoped to its account. It is inserted, the charge made and
-- the reply saved in one transaction, so a committed row always has its reply, and a
-- charge never exists without its key. request_amount_cents is the request's fingerprint:
-- the same key with another amount is refused.
CREATE TABLE idempotency_keys (
    account_id           TEXT NOT NULL,
    idempotency_key      TEXT NOT NULL,
    request_amount_cents BIGINT NOT NULL,
    charge_id            UUID,
    balance_cents        BIGINT,
    created_at           TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (account_id, idempotency_key)
);

-- The retention purge deletes the oldest keys first.
CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);
