"""The peers readers would pick instead (the `peers` dependencies): DBOS and LangGraph."""
