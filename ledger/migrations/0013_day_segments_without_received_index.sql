-- Version 13: the index of observations by receive time on the permanent segment only. Retention
-- asks it for the permanent segment's old observations; a day segment is retired whole, by its
-- streams, and nothing reads its observations by receive time alone, so every snapshot appended
-- to a day segment wrote an index entry nobody used. A partition's index cannot leave its
-- parent's, so the parent's goes (with every partition's) and the permanent segment's is built
-- again, under the same name.
DROP INDEX events_observation_received_idx;
CREATE INDEX events_permanent_observation_received_idx ON events_permanent (received_at)
    WHERE event_class = 'observation';
