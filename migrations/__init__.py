"""Alembic environment and versions of the store schema (SQLite and PostgreSQL); applied by receipts.db."""
