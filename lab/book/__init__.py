"""The book: tables, figures and chapters from verified evidence only."""
