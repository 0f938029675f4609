"""The shared rules every stage imports: dtypes, masking, argument checks, groups.

Private: import its modules directly."""
