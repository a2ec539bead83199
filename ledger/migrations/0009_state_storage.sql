-- Version 9: the folded states are written already compressed (msgpack, deflated, behind a format
-- byte; projections/framework.py), so PostgreSQL stores them as they come instead of trying to
-- compress them again. A checkpoint written as JSON before stays as it is and still decodes; it
-- is written in the new encoding with the stream's next event.
ALTER TABLE projection_state ALTER COLUMN state SET STORAGE EXTERNAL;
