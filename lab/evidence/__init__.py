"""Evidence: compile a run into a signed report, verify it offline, and the gate."""
