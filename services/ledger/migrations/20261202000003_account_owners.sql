-- An account belongs to the caller that created it (the identity the edge authenticated,
-- `x-caller`; '' for the anonymous caller of an edge that admits one). Accounts made
-- before callers were told apart are the anonymous caller's. Adding a column with a
-- constant default rewrites nothing.
SET LOCAL lock_timeout = '2s';

ALTER TABLE accounts ADD COLUMN owner TEXT NOT NULL DEFAULT '';
