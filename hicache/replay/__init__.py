"""`hicache replay`: KV-cache traces through real sidecars, against an exact prefix LRU."""
