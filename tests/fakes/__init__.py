"""Test doubles (never imported by the application)."""
