-- The bare handler's work: one autocommitted INSERT.
INSERT INTO charges (account, amount, currency) VALUES ('acct_1', 100, 'usd') RETURNING id;
