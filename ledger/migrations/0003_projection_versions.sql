-- Version 3: the shape each read model was last built with. A release that changes what a
-- projection keeps (its persisted state or its rows) raises that projection's `version` in code;
-- `migrate` (and `serve` at start) then rebuilds it from the log, so a read model is never
-- compared with, or served from, the shape of an older release. No row: the first release's
-- shape (version 1).
CREATE TABLE projection_versions (
    projection  text PRIMARY KEY,
    version     integer NOT NULL,
    built_at    timestamptz NOT NULL DEFAULT now()
);
