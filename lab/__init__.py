"""Durable agent workflow lab."""
