"""Glue to other libraries, each imported only when that library is."""
