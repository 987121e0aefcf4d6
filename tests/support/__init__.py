"""Test support: the fake engine, the live-server harness, shared fixtures and file builders."""
