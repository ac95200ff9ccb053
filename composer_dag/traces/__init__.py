"""Production sessions: the ``composer-session/1`` format, taking an hour of sessions in,
deletion, and a stand-in for production (plain Python, no Dagster).

    rows, summary = intake([(name, data)], "2026-12-04-13:00", known_models={version: digest})
"""
