"""Input builders: chat templates, media loading, preprocessing into shm. Arrives with the
routers / input-builders issue; see ../shared/DESIGN.md §4."""
