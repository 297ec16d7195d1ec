"""Process plumbing that any component may use: disk-full errors, temp folders, heap trimming, progress."""
