"""A rank that never ends by itself."""

import time

if __name__ == "__main__":
    while True:
        time.sleep(1)
