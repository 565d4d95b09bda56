"""Session logs: writing and reading them, replaying and verifying a session, exporting it for
other tools.
"""
