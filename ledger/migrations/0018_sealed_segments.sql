-- Version 18: a day segment's indexes are rebuilt packed once its day is over (ledger/sealing.py,
-- docs/storage.md); `sealed_at` records when. The segments an upgraded database holds are sealed
-- by the first retention passes after the upgrade (today's once its day is over).
ALTER TABLE event_segments ADD COLUMN sealed_at timestamptz;
