-- Fails the statement that calls it unless `p_ok`: an SQL statement's own check of what its
-- data-modifying parts did (ledger/folded_append.py), where no later statement of a transaction
-- could roll it back. NULL counts as failed.
CREATE OR REPLACE FUNCTION mf_require(p_ok boolean, p_code text, p_message text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_ok IS NOT TRUE THEN
        RAISE EXCEPTION '%', p_message USING ERRCODE = p_code;
    END IF;
    RETURN true;
END;
$$;
