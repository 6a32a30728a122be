"""Postgres adapter: tables, engine, the event log and its projections."""
