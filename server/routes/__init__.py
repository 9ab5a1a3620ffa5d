"""HTTP routes, one `APIRouter` per family."""
