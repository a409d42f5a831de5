//! Claims one key in Postgres, prints its token, and hangs before completing: the SIGKILL test
//! kills it there. Usage: `dedup-claim-and-hang <database-url> <scope> <key> <lease-ms>
//! [<instance-id>]`: with an instance identity it adopts first (taking the identity, as a runner
//! does at start) and claims as that instance.

use std::time::Duration;

use dedup_core::{
    ClaimOutcome, ClaimRequest, Dedup, IdempotencyKey, InstanceId, OwnerId, Policy, Scope, Store,
};
use dedup_pg::PgStore;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (url, scope, key, lease_ms, instance) = match args.as_slice() {
        [_, url, scope, key, lease_ms] => (url, scope, key, lease_ms, None),
        [_, url, scope, key, lease_ms, id] => (url, scope, key, lease_ms, Some(id)),
        _ => {
            return Err(
                "usage: dedup-claim-and-hang <database-url> <scope> <key> <lease-ms> [<instance-id>]"
                    .into(),
            );
        }
    };
    let store = PgStore::new(sqlx::PgPool::connect(url).await?);
    let key = IdempotencyKey::new(Scope::new(scope)?, key)?;
    let policy = Policy::default().with_lease(Duration::from_millis(lease_ms.parse()?));
    let owner = match instance {
        Some(id) => {
            let dedup = Dedup::new(store.clone()).with_instance(InstanceId::new(id.as_str())?);
            dedup.adopt().await?;
            OwnerId::new(format!("{}#0", dedup.owner_prefix()))
        }
        None => OwnerId::new(format!("hang-{}", std::process::id())),
    };
    match store
        .claim(&ClaimRequest::new(key, owner).with_policy(policy))
        .await?
    {
        ClaimOutcome::Acquired(lease) => {
            #[allow(clippy::print_stdout)]
            {
                println!("claimed token={}", lease.token);
            }
            // The effect would run here; the test kills us first.
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(())
        }
        other => Err(format!("expected to acquire, got {other:?}").into()),
    }
}
