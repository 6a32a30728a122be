"""The Celery app Flower watches (``celery -A app.control.flower_app flower``): configured
from the settings, so the broker's password never appears on a command line."""

from app.config import get_settings
from app.taskqueue import make_celery

celery = make_celery(get_settings(), "dsec-flower")
