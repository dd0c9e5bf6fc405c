//! Same-key requests queue in memory, not on a database connection.
//!
//! Without this, a second request for a key whose first request is still running would
//! poll the database, or block inside it on the first one's uncommitted row, holding a
//! pooled connection: a burst of duplicates (a client retrying in a loop, a double-click
//! storm) could take every connection and starve other scopes. With it, duplicates in this
//! process wait here, on a per-key async mutex, and go to the database only when the first
//! has finished (to replay its reply). Duplicates arriving at *another* process still meet
//! at the key's record.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, Weak},
};

use tokio::sync::OwnedMutexGuard;

/// The key of one logical operation: keys are unique within a scope.
type Scope = (String, String);

/// One async mutex per (scope, key) in flight in this process.
#[derive(Debug, Default)]
pub struct KeyLocks {
    /// Weak so that an entry lives only while some request holds or waits for it; the last
    /// one out removes it (see [`KeyTurn`]'s `Drop`).
    held: Mutex<HashMap<Scope, Weak<tokio::sync::Mutex<()>>>>,
}

/// The right to run the one request of a key that may run now; released on drop.
#[derive(Debug)]
pub struct KeyTurn {
    /// The map to tidy when the turn ends.
    locks: Arc<KeyLocks>,
    /// Which key.
    scope: Scope,
    /// The held per-key mutex; `None` only while dropping.
    guard: Option<OwnedMutexGuard<()>>,
}

impl KeyLocks {
    /// Waits for this key's turn (callers bound the wait by their deadline).
    pub async fn lock(self: &Arc<Self>, scope: &str, key: &str) -> KeyTurn {
        let scope = (scope.to_owned(), key.to_owned());
        let mutex = self.mutex_for(&scope);
        let guard = mutex.lock_owned().await;
        self.turn(scope, guard)
    }

    /// This key's turn if no other request of it is running or waiting here.
    pub fn try_lock(self: &Arc<Self>, scope: &str, key: &str) -> Option<KeyTurn> {
        let scope = (scope.to_owned(), key.to_owned());
        let mutex = self.mutex_for(&scope);
        let guard = mutex.try_lock_owned().ok()?;
        Some(self.turn(scope, guard))
    }

    /// How many keys have a request running or waiting here (for tests and metrics).
    pub fn len(&self) -> usize {
        self.map().values().filter(|m| m.strong_count() > 0).count()
    }

    /// Whether no key has a request running or waiting here.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn mutex_for(&self, scope: &Scope) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.map();
        if let Some(mutex) = map.get(scope).and_then(Weak::upgrade) {
            return mutex;
        }
        let mutex = Arc::new(tokio::sync::Mutex::new(()));
        map.insert(scope.clone(), Arc::downgrade(&mutex));
        mutex
    }

    fn turn(self: &Arc<Self>, scope: Scope, guard: OwnedMutexGuard<()>) -> KeyTurn {
        KeyTurn {
            locks: Arc::clone(self),
            scope,
            guard: Some(guard),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<Scope, Weak<tokio::sync::Mutex<()>>>> {
        self.held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for KeyTurn {
    fn drop(&mut self) {
        // Release the key first, then forget it unless someone is still waiting for it.
        drop(self.guard.take());
        let mut map = self.locks.map();
        if map
            .get(&self.scope)
            .is_some_and(|mutex| mutex.strong_count() == 0)
        {
            map.remove(&self.scope);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_turn_per_key_and_the_map_empties() {
        let locks = Arc::new(KeyLocks::default());
        let first = locks.lock("alice", "k").await;
        assert!(locks.try_lock("alice", "k").is_none(), "same key waits");
        let other = locks
            .try_lock("bob", "k")
            .expect("keys are unique within a scope");
        assert_eq!(locks.len(), 2);

        let waiter = {
            let locks = Arc::clone(&locks);
            tokio::spawn(async move {
                let _turn = locks.lock("alice", "k").await;
            })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!waiter.is_finished(), "waits while the first runs");
        drop(first);
        waiter.await.expect("the waiter gets its turn");
        drop(other);
        assert!(locks.is_empty(), "no entry outlives its requests");
    }

    #[tokio::test]
    async fn a_cancelled_waiter_leaves_nothing_behind() {
        let locks = Arc::new(KeyLocks::default());
        let first = locks.lock("alice", "k").await;
        let waited = tokio::time::timeout(Duration::from_millis(5), locks.lock("alice", "k")).await;
        assert!(waited.is_err());
        drop(first);
        assert!(locks.is_empty());
    }
}
