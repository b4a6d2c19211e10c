"""The batch contract (columns.py): the names of a batch's columns and markers, low in the house so that the store
writers, the collators, the teacher sources and the patched forward share one spelling."""
