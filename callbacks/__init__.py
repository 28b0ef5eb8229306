"""Lightning callbacks for Keel training: each owns one job and its metrics."""
