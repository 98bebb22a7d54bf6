//! A tool's parameter schema, checked when its component loads: it must be
//! JSON, a JSON Schema the validator compiles, and describe one JSON object
//! (the models pass a tool's arguments as one object, and the providers
//! refuse any other top-level type). A tool whose schema fails is refused at
//! load with the reason, rather than sent to the model as something else.

use serde_json::Value;

/// Why a tool's parameter schema is refused.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error(
        "must describe one JSON object, as {{\"type\": \"object\", \"properties\": {{...}}}}; \
         its top level {0}"
    )]
    NotAnObject(&'static str),
    #[error("is not a valid JSON Schema: {0}")]
    Invalid(String),
}

/// The longest part of a validator's message kept in an error (a hostile
/// schema could make it as long as itself).
const MAX_REASON_BYTES: usize = 512;

/// Checks `schema` and returns it parsed.
pub fn check(schema: &str) -> Result<Value, SchemaError> {
    let value: Value = serde_json::from_str(schema).map_err(SchemaError::NotJson)?;
    let Value::Object(object) = &value else {
        return Err(SchemaError::NotAnObject("is not a JSON object"));
    };
    match object.get("type") {
        Some(Value::String(kind)) if kind == "object" => {}
        Some(_) => {
            return Err(SchemaError::NotAnObject(
                "has a \"type\" other than \"object\"",
            ))
        }
        None => return Err(SchemaError::NotAnObject("has no \"type\"")),
    }
    // The meta-schema first: it names the keyword that is wrong. Compiling
    // then catches what it cannot (a bad `pattern`, a `$ref` to nowhere or
    // outside the schema, which is never fetched).
    jsonschema::meta::validate(&value).map_err(|err| invalid(&err))?;
    jsonschema::validator_for(&value).map_err(|err| invalid(&err))?;
    Ok(value)
}

fn invalid(err: &jsonschema::ValidationError<'_>) -> SchemaError {
    let path = err.instance_path().to_string();
    let mut reason = if path.is_empty() {
        err.to_string()
    } else {
        format!("at {path}: {err}")
    };
    if reason.len() > MAX_REASON_BYTES {
        let mut end = MAX_REASON_BYTES;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
        reason.push('…');
    }
    SchemaError::Invalid(reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_schema_with_properties_passes() {
        let schema = r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}"#;
        assert!(check(schema).is_ok());
        assert!(check(r#"{"type":"object"}"#).is_ok());
    }

    #[test]
    fn a_schema_that_is_not_json_is_refused() {
        for bad in ["", "{", "not json", "{\"type\":\"object\"} trailing"] {
            assert!(
                matches!(check(bad), Err(SchemaError::NotJson(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_schema_for_anything_but_one_object_is_refused() {
        for bad in [
            "[]",
            "true",
            "{}",
            r#"{"type":"string"}"#,
            r#"{"type":["object","null"]}"#,
        ] {
            assert!(
                matches!(check(bad), Err(SchemaError::NotAnObject(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn an_invalid_schema_is_refused_with_the_keyword_that_is_wrong() {
        let err = check(r#"{"type":"object","properties":{"n":{"type":"integr"}}}"#)
            .expect_err("an unknown type is refused");
        let text = err.to_string();
        assert!(text.contains("/properties/n/type"), "{text}");
        for bad in [
            r#"{"type":"object","required":"n"}"#,
            r#"{"type":"object","properties":{"n":{"minimum":"one"}}}"#,
            r#"{"type":"object","properties":{"s":{"type":"string","pattern":"(["}}}"#,
            r#"{"type":"object","properties":{"r":{"$ref":"https://example.com/schema.json"}}}"#,
            r##"{"type":"object","properties":{"r":{"$ref":"#/$defs/missing"}}}"##,
        ] {
            assert!(matches!(check(bad), Err(SchemaError::Invalid(_))), "{bad}");
        }
    }

    #[test]
    fn a_long_reason_is_cut() {
        let name = "x".repeat(10_000);
        let schema = format!(r#"{{"type":"object","properties":{{"n":{{"type":"{name}"}}}}}}"#);
        let err = check(&schema).expect_err("refused");
        assert!(err.to_string().len() < MAX_REASON_BYTES + 100, "{err}");
    }
}
