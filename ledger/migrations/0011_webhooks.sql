-- Version 11: webhook subscriptions, their signing secrets and their recent delivery attempts.
-- agent_stream_positions: the subscription's creation and removal are lifecycle events in the
-- stream `webhooks` (the audit), written in the same transaction as the row; the row holds what
-- delivery needs and the log cannot: its cursor (the last event the receiver acknowledged, in
-- commit order), its retry state and counters. `rebuild` never touches these tables.
CREATE TABLE webhook_subscriptions (
    subscription_id    text PRIMARY KEY,
    url                text NOT NULL,
    event_types        text[] NOT NULL,
    event_classes      text[] NOT NULL,
    node_id            text,
    description        text NOT NULL DEFAULT '',
    state              text NOT NULL DEFAULT 'active'
        CONSTRAINT webhook_subscriptions_state_check CHECK (state IN ('active', 'failing', 'deleted')),
    created_at         timestamptz NOT NULL DEFAULT now(),
    deleted_at         timestamptz,
    cursor_tx_id       xid8 NOT NULL,
    cursor_position    bigint NOT NULL,
    -- Failed attempts in a row at the event after the cursor, and when the next one is due.
    attempts           integer NOT NULL DEFAULT 0,
    next_attempt_at    timestamptz,
    failing_since      timestamptz,
    last_error         text,
    delivered          bigint NOT NULL DEFAULT 0,
    rejected           bigint NOT NULL DEFAULT 0,
    retried            bigint NOT NULL DEFAULT 0,
    last_delivered_at  timestamptz,
    last_position      bigint
);

-- The signing secret of each subscription, apart from everything that is listed, logged or
-- recorded as an event. Kept as given (not a digest): the server signs every delivery with it.
CREATE TABLE webhook_secrets (
    subscription_id  text PRIMARY KEY REFERENCES webhook_subscriptions ON DELETE CASCADE,
    secret           bytea NOT NULL
);

-- Recent delivery attempts per subscription (the delivery worker keeps the newest few hundred).
CREATE TABLE webhook_deliveries (
    delivery_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscription_id  text NOT NULL,
    global_position  bigint NOT NULL,
    event_type       text NOT NULL,
    attempt          integer NOT NULL,
    outcome          text NOT NULL
        CONSTRAINT webhook_deliveries_outcome_check
        CHECK (outcome IN ('delivered', 'retrying', 'rejected', 'failing')),
    status_code      integer,
    duration_ms      double precision NOT NULL,
    response_body    text,
    error            text,
    attempted_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX webhook_deliveries_subscription_idx ON webhook_deliveries (subscription_id, delivery_id);
