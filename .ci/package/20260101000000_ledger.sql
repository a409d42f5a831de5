CREATE TABLE ledger (key bytea PRIMARY KEY, payment bytea NOT NULL);
