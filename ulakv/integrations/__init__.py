"""Adapters that plug ulakv into serving engines."""
