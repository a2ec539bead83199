-- Version 2: scoped operator tokens. The admin token (MODELFORGE_ADMIN_TOKEN / the state
-- directory) is the one full-scope token; rows here are narrower ones, e.g. `viewer` (reads
-- only). Only the SHA-256 of the secret is kept; the token itself is shown once when it is created.
CREATE TABLE operator_tokens (
    token_id       text PRIMARY KEY,
    scope          text NOT NULL CHECK (scope IN ('viewer')),
    secret_sha256  text NOT NULL,
    description    text NOT NULL DEFAULT '',
    created_at     timestamptz NOT NULL DEFAULT now(),
    expires_at     timestamptz,
    revoked_at     timestamptz
);
