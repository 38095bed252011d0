"""verifiers environments for tests/test_verifiers_env.py, loaded by path (`verifiers:<file>.py:<attr>`)."""
