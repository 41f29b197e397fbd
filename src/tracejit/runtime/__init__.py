"""Running a record: programs, checked replay, mismatch messages."""
