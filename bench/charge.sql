-- The ledger's charge transaction, statement for statement (services/ledger/src/store.rs),
-- for pgbench: claim the key, then in one statement update the balance, insert the charge
-- and save the reply on the key row, then commit. A fresh key per transaction, 1000
-- accounts, as `retrychain storm` sends them. (The ledger's processor call, in process,
-- sits between the two statements; with no faults it takes no time.)
\set n random(1, 2000000000)
\set account random(0, 999)
BEGIN;
INSERT INTO idempotency_keys (account_id, idempotency_key, request_amount_cents) VALUES ('pgbench-' || :account, 'pgbench-' || :client_id || '-' || :n, 100) ON CONFLICT DO NOTHING;
WITH account AS (INSERT INTO accounts (account_id, balance_cents, charges) VALUES ('pgbench-' || :account, 100, 1) ON CONFLICT (account_id) DO UPDATE SET balance_cents = accounts.balance_cents + EXCLUDED.balance_cents, charges = accounts.charges + 1, updated_at = now() RETURNING balance_cents), charge AS (INSERT INTO charges (charge_id, account_id, amount_cents, balance_cents, idempotency_key) SELECT gen_random_uuid(), 'pgbench-' || :account, 100, balance_cents, 'pgbench-' || :client_id || '-' || :n FROM account RETURNING charge_id, balance_cents) UPDATE idempotency_keys SET charge_id = charge.charge_id, balance_cents = charge.balance_cents FROM charge WHERE idempotency_keys.account_id = 'pgbench-' || :account AND idempotency_keys.idempotency_key = 'pgbench-' || :client_id || '-' || :n RETURNING charge.balance_cents;
COMMIT;
