//! The conformance suite: written once, run against every `Store`.
//!
//! `conformance!` stamps each case out once per store: the in-memory reference, Postgres (each
//! test in a fresh database), the tiered store (Postgres behind L1 and a Redis of the test's own,
//! or the 3-master Redis Cluster `scripts/test` starts), and the tiered store behind `Batched`
//! (group commit), and the store an `Engine` built by `dedup::Engine::builder()` claims through
//! (the same stack, as users get it), and that stack over the reference store (an engine built
//! `in_memory()`, for users' tests): seven stores, one module each (`memory::*`, `postgres::*`,
//! ...); a later store adds a module to the macro. Postgres runs twice more over
//! `dedup_records` partitioned by `kt`: `partitioned::*` by the tests' stand-in mapping, which
//! spreads the suite's keys over four partitions, and `switched::*` after the product's switch
//! (`dedup_pg::partition_by_key_time`), whose mapping leaves the suite's keys (none is a UUIDv7)
//! untimed. `cases.rs` covers the store API, the other
//! files the APIs on top of it.

mod cases;
mod instance;
mod process;
mod process_batch;
mod typed;

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let store = std::sync::Arc::new(dedup_core::MemoryStore::new());
                    super::run::$case(store).await;
                }
            )*
        }
        mod postgres {
            $(
                #[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    let store = std::sync::Arc::new(dedup_pg::PgStore::new(pool));
                    super::run::$case(store).await;
                }
            )*
        }

        mod partitioned {
            $(
                #[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    crate::support::partition_records(&pool).await;
                    let store = std::sync::Arc::new(dedup_pg::PgStore::new(pool.clone()));
                    super::run::$case(store).await;
                    assert_eq!(crate::support::misplaced_records(&pool).await, 0);
                }
            )*
        }

        mod switched {
            $(
                #[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    dedup_pg::partition_by_key_time(&pool).await.unwrap();
                    let store = std::sync::Arc::new(dedup_pg::PgStore::new(pool.clone()));
                    super::run::$case(store).await;
                    assert_eq!(crate::support::misplaced_records(&pool).await, 0);
                }
            )*
        }

        mod tiered {
            $(
                #[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    let redis = crate::support::RedisServer::start();
                    let store = std::sync::Arc::new(crate::support::tiered(pool, &redis).await);
                    super::run::$case(store).await;
                }
            )*
        }
        mod tiered_cluster {
            $(
                #[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    let store = std::sync::Arc::new(crate::support::tiered_cluster(pool).await);
                    super::run::$case(store).await;
                }
            )*
        }
        mod batched {
            $(
                #[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    let redis = crate::support::RedisServer::start();
                    let store = crate::support::tiered(pool, &redis).await;
                    let store = dedup_core::Batched::new(store, dedup_core::BatchConfig::default());
                    super::run::$case(std::sync::Arc::new(store)).await;
                }
            )*
        }
        mod engine {
            $(
                #[sqlx::test(migrator = "dedup_pg::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    let redis = crate::support::RedisServer::start();
                    let engine = dedup::Engine::builder()
                        .postgres(pool)
                        .redis_url(redis.url())
                        .tiers(crate::support::test_config())
                        .scope("conformance")
                        .build()
                        .await
                        .unwrap();
                    super::run::$case(std::sync::Arc::new(engine.dedup().store().clone())).await;
                }
            )*
        }
        mod engine_in_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let engine = dedup::Engine::builder()
                        .in_memory()
                        .scope("conformance")
                        .build()
                        .await
                        .unwrap();
                    super::run::$case(std::sync::Arc::new(engine.dedup().store().clone())).await;
                }
            )*
        }
        mod run {
            pub(super) use super::cases::*;
            pub(super) use super::instance::*;
            pub(super) use super::process::*;
            pub(super) use super::process_batch::*;
            pub(super) use super::typed::*;
        }
    };
}

conformance!(
    // claims and the state machine
    new_key_is_acquired,
    absent_key_reads_none,
    live_lease_answers_in_flight,
    completed_key_replays_its_result,
    payload_mismatch_is_refused_in_every_state,
    stale_token_is_fenced_out_of_every_call,
    retryable_failures_release_then_fail,
    permanent_failure_makes_poison,
    expiring_leases_exhaust_the_attempts,
    extend_keeps_the_lease_alive,
    concurrent_claims_have_one_winner,
    purge_is_bounded_and_takes_only_expired_records,
    a_record_past_retention_runs_again,
    tokens_never_repeat_after_a_purge,
    scopes_are_isolated,
    binary_keys_are_kept_as_bytes,
    longest_key_and_scope_round_trip,
    oversized_result_is_refused_and_changes_nothing,
    invalid_policy_is_refused,
    batch_calls_answer_in_order,
    batch_claim_answers_like_single_claims,
    batch_completion_is_fenced_per_item,
    concurrent_batches_grant_each_key_once,
    withdraw_gives_the_attempt_back,
    // the consumer API on top of the store
    process_executes_once_and_replays,
    process_releases_on_a_retryable_error,
    process_poisons_on_a_permanent_error,
    process_heartbeat_outlives_the_lease,
    process_waits_for_an_in_flight_duplicate,
    try_process_answers_a_held_key_at_once,
    process_fails_a_key_whose_result_is_too_large,
    process_reads_back_an_unknown_completion,
    process_reads_back_an_unknown_claim,
    process_adopts_its_own_claim_after_a_failed_read_back,
    process_storm_runs_each_key_once,
    process_keeps_completing_while_the_lease_holds,
    process_gives_up_completing_at_the_callers_deadline,
    process_catches_a_panicking_handler,
    process_withdraw_spends_no_attempt,
    // lease mode by the batch
    process_batch_runs_each_key_once_and_answers_repeats,
    process_batch_fails_each_message_alone,
    process_batch_does_not_wait_for_a_held_key,
    process_batch_heartbeat_outlives_the_lease,
    process_batch_taken_over_is_fenced_whole,
    process_batch_adopts_its_own_claims_after_lost_replies,
    process_batch_one_heartbeat_serves_every_running_batch,
    // instance identities
    adopt_ends_only_a_dead_predecessors_leases,
    adopt_needs_a_valid_identity,
    // typed results
    typed_result_is_replayed_equal,
    typed_result_of_another_type_is_refused,
    typed_result_that_cannot_be_encoded_fails_the_key,
    typed_results_that_need_a_self_describing_codec,
);
