"""Flash/SSD offloading (see issue 5)."""
