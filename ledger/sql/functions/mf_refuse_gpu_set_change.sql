-- A GPU set is named by the compact snapshots of format 3 that list its GPUs by index: changing
-- or removing it would leave them undecodable, so the database refuses it (trigger
-- gpu_sets_immutable; TRUNCATE is refused by mf_refuse_truncate).
CREATE OR REPLACE FUNCTION mf_refuse_gpu_set_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'GPU set % is named by the log''s snapshots: % refused', OLD.sampled, TG_OP
        USING ERRCODE = 'restrict_violation';
END;
$$;
