-- One GPU's sample from the event at `p_position` (hw_accelerator_telemetry.position): its
-- metrics, and its health signals (null where the agent sent none); of a GPU listed twice in a
-- snapshot the last entry, as in mf_samples. For a query of a GPU at a time (a page of
-- accelerators: its GPUs are of as many nodes). A path query builds only the matching entry,
-- where expanding the snapshot would build all of them.
CREATE OR REPLACE FUNCTION mf_accelerator_sample(p_position bigint, p_uuid text)
RETURNS TABLE (metrics jsonb, health_signals jsonb)
LANGUAGE sql STABLE AS $$
    SELECT x.sample->'telemetry', nullif(x.sample->'health', 'null'::jsonb)
    FROM (SELECT CASE WHEN e.event_type = 'ACCELERATOR_TELEMETRY_OBSERVED' THEN e.data
                      ELSE jsonb_path_query_array(e.data, '$.accelerators[*] ? (@.uuid == $u)',
                                                  jsonb_build_object('u', p_uuid))->-1 END AS sample
          FROM events e WHERE e.global_position = p_position OFFSET 0) x
$$;
