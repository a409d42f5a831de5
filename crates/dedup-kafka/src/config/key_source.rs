//! Where a message's idempotency key comes from: [`KeySource`], and the check that its settings
//! can work, and that the sources of a list give one event one key.

use super::ConfigError;

/// Where a message's idempotency key comes from.
///
/// Sources that find the same value give the same key bytes when they make them the same way:
/// a `Header` and a `JsonPointer` take the value as is (the header `event-id: abc` and the field
/// `{"id":"abc"}` give one key; so do `event-id: 42` and `{"id":42}`); `Fields` of as many fields
/// take a digest of the values; `Timed` sources make a time-ordered key of the event's time and
/// their id, alike when their ids are found alike. This is what a [`FirstOf`](Self::FirstOf) list
/// is checked against.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum KeySource {
    /// The value of this header (the default: `idempotency-key`).
    Header(String),
    /// The value at this JSON pointer (RFC 6901, such as `/order/id`) in a JSON payload. A string
    /// is taken as is; a number or boolean as its JSON text.
    JsonPointer(String),
    /// A digest of the values at these JSON pointers: for producers that send no key, the fields
    /// that make two messages the same event (such as `/account` and `/request_id`).
    Fields(Vec<String>),
    /// A random event id (found as `id` says) keyed with the event's own time
    /// ([`IdempotencyKey::timed`](dedup_core::IdempotencyKey::timed)): a time-ordered key, which
    /// keeps a large window as cheap as UUIDv7 ids do (docs/PERFORMANCE.md, "Time-ordered event
    /// ids"). The time must be the one the producer gave the event and that every copy of it
    /// carries, never a broker's timestamp: a copy with another time is another key, and runs
    /// the effect again. A message without the time is one without a key ([`MissingKey`]); a
    /// time that is neither a whole number of milliseconds nor an RFC 3339 timestamp is
    /// dead-lettered with the reason. As with
    /// any change of a consumer's key source, a copy of an event processed under the old one
    /// gets another key, and runs again.
    ///
    /// [`MissingKey`]: crate::MissingKey
    Timed {
        /// Where the event id is. Only its digest goes into the key, so it may be longer than a
        /// key may be.
        id: Box<KeySource>,
        /// Where the event's time is.
        time: EventTime,
    },
    /// The first of these sources that finds a key, tried in order ([`KeySource::first_of`]):
    /// for producers that send the key one way only sometimes (the `event-id` header, else the
    /// payload's `/id`).
    ///
    /// A source that finds nothing (no such header, nothing at the pointer, an empty payload, a
    /// timed source's id or time absent) hands over to the next. A source that finds something
    /// that is no key (an empty or too long value, an object at the pointer, a payload that is
    /// not JSON, an unreadable time) is the message's error, dead-lettered with the reason: it
    /// never hands over, so a copy whose header is bad never runs under its field's key. A
    /// message that no source keys is one without a key ([`MissingKey`]), its reason naming
    /// every source tried.
    ///
    /// Every source of the list must give the same key bytes for the same event: otherwise a
    /// copy with the header and a copy without it get two keys, and the effect runs twice. The
    /// runner's check refuses a list whose sources can never agree (see [`KeySource`]): a timed
    /// source beside an untimed one, a `Fields` digest beside a value taken as is, `Fields` of
    /// different numbers of fields. What it cannot check is the producer: the header and the
    /// field must carry the same value. An empty list, and a list inside a list or inside a
    /// timed source's id, are refused too: list timed sources instead.
    ///
    /// [`MissingKey`]: crate::MissingKey
    FirstOf(Vec<KeySource>),
}

impl KeySource {
    /// [`KeySource::Timed`]: the event id found as `id` says, keyed with its time found as `time`
    /// says.
    pub fn timed(id: KeySource, time: EventTime) -> Self {
        Self::Timed {
            id: Box::new(id),
            time,
        }
    }

    /// [`KeySource::FirstOf`]: the first of `sources` that finds a key, tried in order.
    pub fn first_of(sources: impl IntoIterator<Item = KeySource>) -> Self {
        Self::FirstOf(sources.into_iter().collect())
    }

    /// Checks the source's settings, and that the sources of a list can agree; the error's
    /// setting is `key`.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.form(true).map(drop)
    }

    /// How the source makes key bytes of what it finds, once its settings are checked. `top`:
    /// whether it is the key itself, where a list may be.
    fn form(&self, top: bool) -> Result<Form, ConfigError> {
        let refuse = |problem: String| Err(ConfigError::new("key", problem));
        let pointer = |p: &str| {
            if p.is_empty() || p.starts_with('/') {
                Ok(())
            } else {
                Err(ConfigError::new(
                    "key",
                    format!("{p:?} is not a JSON pointer"),
                ))
            }
        };
        match self {
            Self::Header(h) if h.is_empty() => refuse("empty header name".into()),
            Self::Header(_) => Ok(Form::Text),
            Self::JsonPointer(p) => pointer(p).map(|()| Form::Text),
            Self::Fields(f) if f.is_empty() => refuse("no fields to digest".into()),
            Self::Fields(f) => {
                f.iter().try_for_each(|p| pointer(p))?;
                Ok(Form::Digest(f.len()))
            }
            Self::Timed { id, time } => {
                match time {
                    EventTime::Header(h) if h.is_empty() => {
                        return refuse("empty event time header name".into());
                    }
                    EventTime::JsonPointer(p) => pointer(p)?,
                    EventTime::Header(_) => {}
                }
                Ok(Form::Timed(Box::new(id.form(false)?)))
            }
            Self::FirstOf(_) if !top => refuse(
                "a list of key sources goes at the top of the key, not inside another list or \
                 a timed source's id: list timed sources instead"
                    .into(),
            ),
            Self::FirstOf(sources) => {
                let Some((first, rest)) = sources.split_first() else {
                    return refuse("an empty list of key sources".into());
                };
                let form = first.form(false)?;
                for other in rest {
                    let theirs = other.form(false)?;
                    if theirs != form {
                        return refuse(format!(
                            "{} makes {form} and {} makes {theirs}: they never give one event \
                             the same key, and a copy keyed by each would run twice",
                            first.label(),
                            other.label(),
                        ));
                    }
                }
                Ok(form)
            }
        }
    }

    /// The source, as an error names it.
    fn label(&self) -> String {
        match self {
            Self::Header(h) => format!("header {h:?}"),
            Self::JsonPointer(p) => format!("JSON pointer {p:?}"),
            Self::Fields(f) => format!("fields {f:?}"),
            Self::Timed { id, .. } => format!("timed {}", id.label()),
            Self::FirstOf(_) => "a list of key sources".into(),
        }
    }
}

/// How a source makes key bytes of what it finds: sources of one form give equal bytes for equal
/// values, sources of two forms never do.
#[derive(Clone, PartialEq, Eq, Debug)]
enum Form {
    /// The value as is.
    Text,
    /// A digest of this many fields.
    Digest(usize),
    /// A time-ordered key of the event's time and a digest of its id, found in this form.
    Timed(Box<Form>),
}

impl std::fmt::Display for Form {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Text => f.write_str("the value as is"),
            Self::Digest(n) => write!(f, "a digest of {n} fields"),
            Self::Timed(id) => write!(f, "a time-ordered key (its id {id})"),
        }
    }
}

/// Where an event's own time is, for [`KeySource::Timed`]: milliseconds since the Unix epoch,
/// as a JSON number or as decimal digits (in a JSON string or a header), or an RFC 3339
/// timestamp (in a JSON string or a header: CloudEvents' `time`, `ce_time` in Kafka's binary
/// mode), read to the millisecond ([`event_time_ms`](crate::event_time_ms)).
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum EventTime {
    /// The value of this header.
    Header(String),
    /// The value at this JSON pointer (RFC 6901, such as `/created_ms`) in a JSON payload.
    JsonPointer(String),
}

impl Default for KeySource {
    fn default() -> Self {
        Self::Header(DEFAULT_KEY_HEADER.to_owned())
    }
}

/// The header [`KeySource::default`] reads.
pub const DEFAULT_KEY_HEADER: &str = "idempotency-key";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RunnerConfig;

    fn check(key: KeySource) -> Result<(), ConfigError> {
        RunnerConfig::new("127.0.0.1:9092", "g", ["t"])
            .with_key(key)
            .validate()
    }

    #[test]
    fn lists_whose_sources_can_never_agree_are_refused_as_key() {
        let header = || KeySource::Header("event-id".into());
        let field = || KeySource::JsonPointer("/id".into());
        let fields = |n: usize| KeySource::Fields((0..n).map(|i| format!("/f{i}")).collect());
        let timed = |id: KeySource| KeySource::timed(id, EventTime::Header("event-ms".into()));
        for fine in [
            KeySource::first_of([header(), field()]),
            KeySource::first_of([field()]),
            KeySource::first_of([fields(2), fields(2)]),
            KeySource::first_of([
                timed(header()),
                KeySource::timed(field(), EventTime::JsonPointer("/at".into())),
            ]),
        ] {
            assert_eq!(check(fine.clone()), Ok(()), "{fine:?}");
        }
        for (refused, says) in [
            (KeySource::first_of([]), "empty list"),
            (
                KeySource::first_of([KeySource::first_of([header()]), field()]),
                "inside another list",
            ),
            (timed(KeySource::first_of([header(), field()])), "inside"),
            (
                KeySource::first_of([timed(header()), field()]),
                "time-ordered",
            ),
            (
                KeySource::first_of([field(), timed(header())]),
                "time-ordered",
            ),
            (KeySource::first_of([header(), fields(1)]), "digest of 1"),
            (KeySource::first_of([fields(2), fields(3)]), "digest of 3"),
            (
                KeySource::first_of([timed(header()), timed(fields(1))]),
                "digest of 1",
            ),
            (
                KeySource::first_of([field(), KeySource::Header(String::new())]),
                "empty header name",
            ),
            (
                KeySource::first_of([field(), KeySource::JsonPointer("id".into())]),
                "not a JSON pointer",
            ),
            (timed(KeySource::Header(String::new())), "empty header name"),
            (
                KeySource::timed(header(), EventTime::Header(String::new())),
                "event time",
            ),
            (
                KeySource::Fields(vec!["/a".into(), "b".into()]),
                "not a JSON pointer",
            ),
        ] {
            let err = check(refused.clone()).expect_err(says);
            assert_eq!(err.setting, "key", "{err}");
            assert!(err.problem.contains(says), "{refused:?}: {err}");
        }
        // The error names the two sources that disagree.
        let err = check(KeySource::first_of([header(), timed(field())])).expect_err("refused");
        assert!(
            err.problem.contains("header \"event-id\"")
                && err.problem.contains("timed JSON pointer \"/id\""),
            "{err}"
        );
    }
}
