"""ipywidgets explorers, one module per concept.  Each explorer has a static figure beside it
in its chapter (the book is rendered without a kernel; only the saved widget state travels)."""
