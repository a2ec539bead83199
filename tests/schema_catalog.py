"""A database's schema as lines of text from pg_catalog, for comparing two databases: relations
(tables, partitions, indexes, sequences, with their storage settings), columns (in order, with
type, nullability, default, identity and compression), constraints, indexes, triggers and
functions (signature, result, language, volatility, settings and body). The day segments of the
log are left out: they are named by the day they were made on."""

from __future__ import annotations

import asyncpg

DAY_SEGMENT = "^events_d[0-9]{8}$"

CATALOG = r"""
WITH rel AS (
    SELECT c.oid, c.relname, c.relkind, c.reloptions, c.relispartition, c.relpartbound
    FROM pg_class c
    WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p', 'S')
      AND c.relname !~ $1
), lines AS (
    SELECT 'relation ' || r.relname || ' ' || r.relkind::text
           || ' options=' || coalesce((SELECT string_agg(o, ',' ORDER BY o) FROM unnest(r.reloptions) o), '')
           || CASE WHEN r.relispartition THEN ' partition ' || pg_get_expr(r.relpartbound, r.oid) ELSE '' END
           AS line
    FROM rel r
    UNION ALL
    SELECT 'column ' || r.relname || ' #' || row_number() OVER (PARTITION BY r.oid ORDER BY a.attnum)
           || ' ' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
           || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
           || coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), '')
           || CASE WHEN a.attidentity <> '' THEN ' identity ' || a.attidentity::text ELSE '' END
           || CASE WHEN a.attgenerated <> '' THEN ' generated' ELSE '' END
           || CASE WHEN a.attcompression <> '' THEN ' compression ' || a.attcompression::text ELSE '' END
    FROM rel r
    JOIN pg_attribute a ON a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped
    LEFT JOIN pg_attrdef d ON d.adrelid = r.oid AND d.adnum = a.attnum
    WHERE r.relkind IN ('r', 'p')
    UNION ALL
    SELECT 'constraint ' || r.relname || ' ' || k.conname || ' ' || k.contype::text || ' '
           || pg_get_constraintdef(k.oid) || CASE WHEN k.conislocal THEN '' ELSE ' inherited' END
    FROM rel r JOIN pg_constraint k ON k.conrelid = r.oid
    UNION ALL
    SELECT 'index ' || pg_get_indexdef(i.indexrelid)
    FROM rel r JOIN pg_index i ON i.indrelid = r.oid
    UNION ALL
    SELECT 'trigger ' || r.relname || ' ' || pg_get_triggerdef(t.oid)
    FROM rel r JOIN pg_trigger t ON t.tgrelid = r.oid
    WHERE NOT t.tgisinternal
    UNION ALL
    SELECT 'function ' || p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ') '
           || pg_get_function_result(p.oid) || ' ' || l.lanname || ' ' || p.provolatile::text
           || ' config=' || coalesce(array_to_string(p.proconfig, ','), '')
           || ' body=' || md5(p.prosrc)
    FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
    WHERE p.pronamespace = 'public'::regnamespace
)
SELECT line FROM lines ORDER BY line
"""


async def catalog(conn: asyncpg.Connection) -> list[str]:
    return [r["line"] for r in await conn.fetch(CATALOG, DAY_SEGMENT)]
